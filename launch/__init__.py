"""mcorekit.launch"""
