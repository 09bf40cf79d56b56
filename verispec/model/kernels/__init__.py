"""Native CPU kernels for the lean forward: rows.cpp (C++ source, built once per machine by
build.py) and rows.py (the products and attention that call it)."""
