"""Ember node-side code: runtime server, engines, sensors, prewarm, device plugin."""
