"""``python -m jax_nvfp4``: what this installation was built with and what runs on the current devices."""

from jax_nvfp4.build_info import main

main()
