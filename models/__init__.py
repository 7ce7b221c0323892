"""Model descriptions shared by launch/, train/ and convert/."""
