"""Model building blocks: tensor-parallel linear/embedding layers, norms, rotary, attention."""
