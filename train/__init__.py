"""mcorekit.train"""
