"""The OpenAI API, transport-free: request models, the chat/completions handlers over
``OpenAIServing`` (preprocess and generate as plain callables), tool-call parsing."""
