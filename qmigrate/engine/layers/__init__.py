"""The pieces every model of engine/models/ is built from: weights taken from a loaded
transformers checkpoint, maths over the paged pool."""
