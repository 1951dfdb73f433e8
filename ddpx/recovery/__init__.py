"""Live recovery across replica groups on torchft (elastic.recovery: live)."""
