//go:build !ftcomm_diag

package main

import "time"

// diagOn: a diagnostic build (diag.go) times the ops; this one does not.
const diagOn = false

func diagEnd(time.Time) {}
