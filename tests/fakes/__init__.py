"""Test doubles for the middle ring: fake Triton servers that record what they receive, a raw
HTTP client that sends bytes no HTTP library would, the proxy as a separate process, and the
route table a test checks recorded paths against."""
