"""OpenAI's Files and Batch API: durable batches replayed through the gateway beside live traffic."""
