package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/comm"
)

// decode reads a settings object (JSON) strictly: an unknown field is an
// error, so a misspelt setting is never silently ignored.
func decode(s string, v any) error {
	if strings.TrimSpace(s) == "" {
		return nil
	}
	d := json.NewDecoder(strings.NewReader(s))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return fmt.Errorf("%w: settings: %v", comm.ErrInvalidArgument, err)
	}
	return nil
}

// seconds converts a settings duration (seconds, fractions allowed).
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// newLogger is the zap logger of one handle: level "debug", "info",
// "warn" (default, or $FTCOMM_LOG_LEVEL), "error" or "off", to stderr.
func newLogger(level, name string) (*zap.Logger, error) {
	if level == "" {
		level = os.Getenv("FTCOMM_LOG_LEVEL")
	}
	if level == "" {
		level = "warn"
	}
	if level == "off" || level == "none" {
		return zap.NewNop(), nil
	}
	lv, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("%w: log level %q (want debug, info, warn, error or off)", comm.ErrInvalidArgument, level)
	}
	cfg := zap.NewDevelopmentConfig()
	cfg.Level = zap.NewAtomicLevelAt(lv)
	cfg.DisableStacktrace = true
	// No error output: zap's own complaints (a package raising the level
	// of a logger already above it, say) are noise to a Python user.
	cfg.OutputPaths, cfg.ErrorOutputPaths = []string{"stderr"}, nil
	l, err := cfg.Build()
	if err != nil {
		return nil, err
	}
	return l.Named(name), nil
}
