"""emulation"""
