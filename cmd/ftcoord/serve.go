package main

import (
	"context"
	"io"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/coordinator/server"
)

// newLogger logs at level and above to w, as tab-separated lines
// (format "console") or one JSON object a line ("json": ts, level,
// logger, msg and the fields, as collectors such as Fluent Bit, Vector or
// Loki's promtail parse them).
func newLogger(level, format string, w io.Writer) *zap.Logger {
	var lvl zapcore.Level
	_ = lvl.Set(level)
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	encoder := zapcore.NewConsoleEncoder(enc)
	if format == "json" {
		encoder = zapcore.NewJSONEncoder(enc)
	}
	return zap.New(zapcore.NewCore(encoder, zapcore.AddSync(w), lvl))
}

// serve runs a coordinator instance until ctx ends (SIGTERM/SIGINT in
// main), then shuts down gracefully.
func serve(ctx context.Context, cfg serveConfig, stderr io.Writer) error {
	lg := newLogger(cfg.LogLevel, cfg.LogFormat, stderr).With(zap.String("instance", cfg.Name))
	defer lg.Sync()
	sc, err := cfg.serverConfig()
	if err != nil {
		return err
	}
	b := currentBuild()
	sc.Logger, sc.Version, sc.Revision = lg, b.Version, b.Revision
	lg.Info("starting", zap.String("version", b.Version), zap.String("revision", b.Revision), zap.String("go", b.GoVersion))
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
