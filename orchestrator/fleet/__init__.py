"""The fleet: which workers exist, their health, role and load (fed by the health and scrape loops)."""
