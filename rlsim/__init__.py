"""rlsim"""
