"""tandem: an LLM inference engine built around draft-model speculative decoding."""
