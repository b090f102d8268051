"""cost"""
