//go:build !race

package gloo

// Without the race detector there is nothing to tell it (see race.go).

func raceRelease() {}

func raceAcquire() {}
