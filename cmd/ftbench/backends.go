package main

// The backends ftbench can run (-backend); each registers itself with comm.
import (
	_ "github.com/ftcomm/ftcomm/backends/gloo"
)
