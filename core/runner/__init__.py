"""The model runner: block ids to the model's inputs, on the model's device."""
