"""ae: a streaming autoencoder trainer with per-rank observability."""
