"""SparseBalance's command line: ``python main.py {fit,validate,test,profile,export,convert} --config
configs/<name>.yaml`` (``python main.py --help`` lists them), e.g. ``python main.py fit --config configs/demo.yaml``."""

if __name__ == "__main__":
    # imported here, not at the top: processes spawned by this one (litdata's build workers) re-import this file
    # as ``__mp_main__``, and must not pay for the command line's imports (Lightning, transformers)
    from sparsebalance_pl.cli import main

    main()
