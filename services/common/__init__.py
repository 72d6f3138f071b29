"""Small pieces every service and client shares: bearer tokens and retry backoff.

This package holds no service logic, so importing it never couples two services together."""
