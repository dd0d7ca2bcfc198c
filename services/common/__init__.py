"""The layer every service stands on: OpenAI-API plumbing (errors, ids, pagination, files, uploads, OpenAPI
helpers, API keys) and the database a service's store opens. The gateway, the Batch API and the trainer import it
and never each other."""
