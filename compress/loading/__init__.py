"""Loading models: the teacher from a hub id, folder or GGUF file, tiny seeded models, special tokens."""
