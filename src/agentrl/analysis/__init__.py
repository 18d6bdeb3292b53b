"""Offline analysis: gate statistics, tier reports, figures."""
