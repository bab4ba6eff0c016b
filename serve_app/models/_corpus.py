"""Small built-in English text used to train the tiny-qwen2 BPE tokenizer.

It only has to give the tokenizer realistic merges (common words, numbers,
punctuation, JSON and chat markup); content quality is irrelevant because the
model weights are random. Changing it changes the vocabulary, so bump
``tiny_qwen2.RECIPE`` when editing.
"""

from __future__ import annotations

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain.
Rome is the capital of Italy. London is the capital of the United Kingdom. Tokyo is the capital of Japan.
What is the capital of France? The capital of France is Paris. Answer in one word: Paris.
Hello! How can I help you today? I am a helpful assistant, and I am happy to answer your questions.
Thank you very much. You are welcome. Please let me know if there is anything else I can do for you.
The weather today is sunny with a few clouds, and the temperature is around twenty degrees.
Tomorrow it will rain in the morning, but the afternoon should be dry and warm.
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
The Earth orbits the Sun once every year, and the Moon orbits the Earth about once a month.
There are seven days in a week, twelve months in a year, and twenty four hours in a day.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 20 25 32 42 50 64 100 128 256 512 1000 1024 2048 4096.
Dates such as 2024-01-15, 1999-12-31 and 2030-06-30 appear often, and so do times like 09:30 and 17:45.
A function takes arguments and returns a value. A list holds items in order, and a map holds keys and values.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "capital of France", "limit": 5}}
{"type": "function", "function": {"name": "get_time", "description": "Get the current time.", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
[1, 2, 3], {"a": true, "b": false, "c": null}, "hello world", 'single quotes', (x, y).
The system prompt tells the assistant how to behave. The user asks a question, and the assistant answers it.
Once upon a time there was a little girl who lived in a village near the forest.
She liked to read books, to draw pictures, and to walk with her dog along the river.
One day she found a small box under an old tree. Inside the box there was a map and a golden key.
She followed the map over the hills, across the bridge, and through the tall grass.
At the end of the path she found a door in the rock. The key fit the lock, and the door opened.
Behind the door was a library full of books about stars, oceans, mountains, animals and machines.
She read until the sun went down, and then she walked home, happy and tired, with a book under her arm.
Computers store information as bits. Eight bits make a byte. Text is encoded as bytes using UTF-8.
A model reads tokens, predicts the next token, and repeats until it reaches the end of the text.
Servers receive requests, process them, and send responses. Latency and throughput are measured carefully.
Good software is tested, documented, and easy to change. Small steps are safer than large ones.
Questions? Answers! Lists; colons: dashes - and underscores _ and slashes / and back\\slashes.
Please summarize the following text in one sentence. Translate this sentence into French.
Write a short poem about the sea. Explain why the sky is blue. Count from one to ten.
one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday. January February March April May June July
August September October November December. Spring summer autumn winter. North south east west.
Red orange yellow green blue indigo violet black white gray brown pink purple gold silver.
"""
