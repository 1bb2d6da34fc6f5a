"""One evaluation path for every method: sliding-window perplexity and passkey retrieval."""
