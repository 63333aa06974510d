"""The checks of lessons 01-06 (the gridworld, REINFORCE, baselines, GAE, TRPO, PPO's clip): one module per lesson."""
