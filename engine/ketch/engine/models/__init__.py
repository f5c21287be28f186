"""Model implementations (paddle) and Hugging Face checkpoint loading."""
