"""The C kernels: the builder (`cbuild`), their sources (`csrc/`) and the ctypes wrappers that call them."""
