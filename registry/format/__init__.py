"""The on-disk format: names, the ref grammar, manifests and safetensors; imports only the base modules."""
