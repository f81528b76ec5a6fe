"""Chorus ui package."""
