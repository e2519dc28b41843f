//go:build !amd64

package reduce

import "github.com/ftcomm/ftcomm/comm"

func sumF32(d, a, b []float32) { apply3(comm.Sum, d, a, b) }
func sumF64(d, a, b []float64) { apply3(comm.Sum, d, a, b) }
