"""Text as the models see it: `chat` (conversations and prompts -> token ids, the chat template's
assistant spans) and `request_log` (a server's finished requests, written as rotated JSONL shards
and read back as conversations for training)."""
