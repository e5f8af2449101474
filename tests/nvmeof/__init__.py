"""Tests for the standalone nvmeof package (target side)."""
