"""Adapting a Hugging Face model: the support contract (`support`) and what it checks (the routing probe, the
exactness check, the float32 replica, length-dependent RoPE), and one caller at a time per model (`guard`)."""
