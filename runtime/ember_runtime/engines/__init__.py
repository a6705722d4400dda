"""Inference engines behind one interface (`base.Engine`)."""
