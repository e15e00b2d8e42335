"""Finding models: local directories, cached demo models, hub ids; demo fetch and GGUF conversion."""
