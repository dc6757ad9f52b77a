from npuprep.cli.start import entry

entry()
