// Command fitcache runs and inspects FitCache servers.
//
//	fitcache serve [--embedded] [--socket PATH | --listen HOST:PORT --token-file F] [--tiers SPEC] [--root DIR]... [--prefetch N]
//	fitcache stats [--json]
//	fitcache ls [--json] [--socket PATH]
//	fitcache ls --node [--dir DIR]... [--json]
//	fitcache clear [--dry-run] [--json] [--socket PATH] (DIR | --all)
//	fitcache clear --node [--user NAME|UID] [--dir DIR]... [--dry-run] [--json]
//	fitcache stop [--timeout D]
//	fitcache info  [--json]
//	fitcache verify [--tiers SPEC]
//	fitcache warmup [--quiet] DIR
//	fitcache prefetch [--wait] [-0] [--quiet] [--json] DIR < LIST
//	fitcache run --data DIR [--data DIR]... [--prefetch N] [--prefetch-only P]... [--prefetch-exclude P]... -- CMD [ARGS...]
//	fitcache preload-path
//	fitcache token FILE
//	fitcache size --compute-time T [--eta E] [--beta B] [--servers LIST|N] DATASET_DIR
//
// Configuration comes from flags, then FITCACHE_* environment variables, then defaults (see
// config.Load). The Python package installs this program as its `fitcache` command.
package main

import (
	"fmt"
	"log/slog"
	"os"
)

var commands = map[string]func(args []string) error{
	"serve":    serve,
	"stats":    stats,
	"ls":       lsCmd,
	"clear":    clearCmd,
	"stop":     stopCmd,
	"info":     info,
	"verify":   verifyCmd,
	"warmup":   warmup,
	"prefetch": prefetchCmd,
	"token":    tokenCmd,
	"size":     size,
	"run":      run,
	// Hidden: the process `fitcache run` leaves beside the program (see companion).
	"run-companion": companion,
	"preload-path":  preloadPath,
}

func usage() {
	fmt.Fprint(os.Stderr, `usage: fitcache <command> [flags]

commands:
  serve    run a cache server (--embedded: the per-user server clients start on demand)
  stats    print the counters of the embedded server
  info     print the tiers and hardware FitCache finds on this node
  verify   check the checksum of every cached file; remove damaged ones (or say how)
  warmup   cache every file under a directory (a prefetch job), with progress
  prefetch hand the server a list of files (standard input) to read ahead of the readers
  ls       what the cache holds, per dataset root and tier; --node: every user's memory tiers on this node
  clear    drop the cache of a dataset (DIR) or all of it (--all); --dry-run says what would go;
           --node: remove the memory tiers on this node that no live server holds (a job epilog)
  stop     stop the embedded server (the cache stays in its tiers)
  run      run a program with its reads of dataset files served from the cache (LD_PRELOAD)
  preload-path  print the path of the LD_PRELOAD library (for setting LD_PRELOAD yourself)
  token    create a job token file (0600) for the servers and clients of a cluster job
  size     how many servers a job needs (the sizing rule of FITCACHE with a measured server), and their tiers

Run 'fitcache <command> -h' for a command's flags.
`)
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		os.Exit(2)
	}
	cmd, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "fitcache: unknown command %q\n", os.Args[1])
		usage()
		os.Exit(2)
	}
	if err := cmd(os.Args[2:]); err != nil {
		fmt.Fprintf(os.Stderr, "fitcache %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
}
