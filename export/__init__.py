"""mcorekit.export"""
