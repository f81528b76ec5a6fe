"""Chorus tools package."""
