package main

import (
	"context"
	"io"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/cmd/ftcoord/server"
)

func newLogger(level string, w io.Writer) *zap.Logger {
	var lvl zapcore.Level
	_ = lvl.Set(level)
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.AddSync(w), lvl)
	return zap.New(core)
}

// serve runs a coordinator instance until ctx ends (SIGTERM/SIGINT in
// main), then shuts down gracefully.
func serve(ctx context.Context, cfg serveConfig, stderr io.Writer) error {
	lg := newLogger(cfg.LogLevel, stderr).With(zap.String("instance", cfg.Name))
	defer lg.Sync()
	sc, err := cfg.serverConfig()
	if err != nil {
		return err
	}
	sc.Logger = lg
	s, err := server.New(ctx, sc)
	if err != nil {
		return err
	}
	defer s.Close()
	if cfg.AddrFile != "" {
		if err := writeFileAtomic(cfg.AddrFile, []byte(s.URL()+"\n")); err != nil {
			return err
		}
	}
	return s.Serve(ctx)
}

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
