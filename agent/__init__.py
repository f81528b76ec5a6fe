"""Chorus agent package."""
