"""The wire format shared by Python, HTTP and JSON clients."""
