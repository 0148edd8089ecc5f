"""Shared mechanisms that several patches build on. Each target is wrapped by exactly one of them."""
