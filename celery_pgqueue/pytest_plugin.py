"""pytest plugin: a throwaway pgqueue broker for a user's own test suite (being written)."""
