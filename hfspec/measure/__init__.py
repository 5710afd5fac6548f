"""What hfspec measures to choose γ: timing, a step's costs (kept on disk), the acceptance rate α."""
