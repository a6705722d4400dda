"""A site's one OpenAI endpoint: requests routed by model, and by each replica's heat, queue and
cached prefixes (docs/gateway.md)."""
