"""Mixed precision: dtype policy, fp32 master weights, fp16 loss scaling."""
