"""The OpenAI API without transport: protocol models, chat and completions, the serving core."""
