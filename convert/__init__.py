"""mcorekit.convert"""
