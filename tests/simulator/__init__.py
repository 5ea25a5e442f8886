"""Simulator tests."""
