"""A trainer's and an inference peer's defences against strangers (filled in as the modules move here)."""
